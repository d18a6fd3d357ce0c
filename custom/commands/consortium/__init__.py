"""The verbs of whoever runs the federation: ``run``, ``simulate``, ``configure``, ``plan``, ``resume``, ``project``, ``poc``."""
