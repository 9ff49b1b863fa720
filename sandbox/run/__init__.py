"""One test run of one step: prepare -> launch -> guard -> collect -> record."""

from sandbox.run.testrun import RunInterrupted, RunOptions, TestRun, execute_step

__all__ = ["RunInterrupted", "RunOptions", "TestRun", "execute_step"]
