"""`ConfigError`, which every configuration check raises."""


class ConfigError(ValueError):
    """A configuration value, type, key or combination that cannot run."""
