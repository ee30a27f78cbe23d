"""Exceptions raised on bad input. Each carries a message that names the problem."""


class EagletError(Exception):
    """Base class of every error eaglet raises on purpose."""


class ConfigError(EagletError, ValueError):
    """A config.json (or preprocessor_config.json) that eaglet cannot run as written."""


class CheckpointError(EagletError, ValueError):
    """Missing, unexpected or mis-shaped tensors, unreadable shards, unsupported quantization."""


class InvalidRequestError(EagletError, ValueError):
    """A request that cannot be served: bad token ids, placeholder/image mismatch, too long."""


class ImageError(InvalidRequestError):
    """An image that cannot be decoded or processed."""


class RequestFailedError(EagletError, RuntimeError):
    """A request was stopped because the engine step serving it raised; other requests go on."""


class DistributedError(EagletError, RuntimeError):
    """A tensor-parallel rank died, hung past the timeout, or could not join the group: the engine
    cannot go on (every rank holds part of every layer)."""
