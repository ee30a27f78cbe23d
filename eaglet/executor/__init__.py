"""Running models over the requests of a step: each request's state (``Request``) and the model
runner that builds the ragged batch from requests and runs the target over it. The speculative
worker (``eaglet.spec``) and the engine (``eaglet.engine``) both drive models through it."""
