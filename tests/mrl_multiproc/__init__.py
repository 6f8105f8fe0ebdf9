"""Multi-process test scenarios: the launcher (launcher.py) and the scenario modules it runs on every rank."""
