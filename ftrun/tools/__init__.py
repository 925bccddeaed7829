"""Commands that read a job back: ``ftrun status``, ``ftrun report``, ``ftrun check``."""
