"""hybridsim: simulate, execute and check LLM-serving schedules for hybrid and MLA models."""

__version__ = "0.1.0"
