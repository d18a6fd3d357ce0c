"""The error of bad input data or a bad user file, shared below every floor (no FedUQ imports).

:class:`DataError` is the data API's error (re-exported as :class:`feduq.data.DataError`); an output folder a tool
must not write (:class:`feduq.outputs.OutputFolderError`) is one too, so a tool catches both with one clause.
"""


class DataError(ValueError):
    """Bad input data or configuration. The message names the site (center) and the offending file or folder."""
