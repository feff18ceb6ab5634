"""Other engines' RL protocols served as they are, each over the router's core (:class:`router.core.engine.Engine`):
a peer's bodies are translated into the native request once, and its answers built from the native outcome.
docs/api.md has a section per protocol."""
