"""The verbs a hospital's site runs: ``predict``, ``calibrate``, ``report``, ``export-bundle``, ``evaluate``,
``prepare-site``, ``container``, ``fingerprint``."""
