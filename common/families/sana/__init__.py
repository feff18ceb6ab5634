"""SANA (``SanaPipeline``): see :mod:`common.families.sana.binding`."""
