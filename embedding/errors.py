"""Exceptions shared by every stage. CLIs print `SNCAError` messages without a traceback."""


class SNCAError(Exception):
    """A problem the user can fix (bad flag, missing or corrupt file); the message says which."""


class ArtifactError(SNCAError):
    """An artifact (model card, weights, memory bank) is missing, corrupt or incompatible."""


class DataError(SNCAError):
    """A dataset file is missing, corrupt or unreadable; the message names the file."""
