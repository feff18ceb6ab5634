"""What a request is, below every other part of the router: the native request bodies (schemas.py) and a
request image decoded to pixels (images.py). The core, its controls and every HTTP front import them; they
import nothing of the router but its errors."""
