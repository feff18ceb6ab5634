"""The ``disagg`` command: ``disagg serve`` (the engine) and ``disagg generate`` (one video or image)."""
