"""Exceptions of the runtime package."""


class RuntimeJobError(Exception):
    """Base class of every error the runtime raises on purpose."""


class VolumeError(RuntimeJobError):
    """The data volume is missing, unreadable, or kept failing after retries."""


class CheckpointError(RuntimeJobError):
    """No loadable checkpoint, or a checkpoint could not be written."""


class PreflightError(RuntimeJobError):
    """A device failed a preflight check."""


class ExportError(RuntimeJobError):
    """A table export failed for a reason outside the user's input (the disk filled up, the source broke)."""


class ExportInputError(ExportError, ValueError):
    """A table export was asked for something that cannot be: no such table, no such column, a bad filter."""


class ShardError(VolumeError):
    """A shard of a pack is torn or corrupt (its size or checksum differs from the index): re-pack it."""


class PackError(RuntimeJobError):
    """Packing files into shards failed for a reason outside the user's input (the source broke, the disk filled)."""


class PackInputError(PackError, ValueError):
    """Packing was asked for something that cannot be: no such source, a destination that holds other files."""
