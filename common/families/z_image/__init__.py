"""Z-Image (``ZImagePipeline``): see :mod:`common.families.z_image.binding`."""
