"""The error hierarchy raised at moerl's boundaries.

Every message says what went wrong and what to do about it. CLI entry points turn a
`MoerlError` into one line on stderr and a non-zero exit; anything else is a bug and keeps
its traceback.
"""


class MoerlError(Exception):
    """Base class of every error moerl raises on purpose."""

    exit_code = 1


class ConfigError(MoerlError):
    """The run config is invalid. Raised before any work starts."""

    exit_code = 2


class DataError(MoerlError):
    """A dataset or a record between stages is malformed beyond the allowed budget."""


class SourceChanged(MoerlError):
    """A user's model or data object changed (another ETag) after the run listed it."""


class CheckpointError(MoerlError):
    """A checkpoint could not be published, found or verified."""


class StoreUnavailable(CheckpointError):
    """The checkpoint store could not be reached, or answered with a server-side error (an S3
    brownout): the same call may succeed later (`moerl.components.publish_checkpoint.outage`)."""


class WeightSyncError(MoerlError):
    """A policy version could not be made the one the rollout engines serve."""


class TrainingError(MoerlError):
    """Training cannot go on (for example too many non-finite losses in a row)."""


class RequirementError(MoerlError):
    """A piece the config's `require:` block asks for (GPU, DeepEP, EFA) is missing where the
    stage runs. Raised at the stage's start, before any work."""

    exit_code = 2
