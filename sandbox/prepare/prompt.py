"""The `## TEST MODE` section every step prompt gets.

The same words as the stub reply, so an agent that reads either learns the
one rule that matters: continue as if a stubbed call succeeded and never look
for another way to perform it.
"""

from __future__ import annotations

TEST_MODE_SECTION = """\
## TEST MODE

This step is running in TEST MODE: a test run that verifies a change without
real-world side effects.

- Reads are real. Your workflow DB is a copy made for this test run ($DB_PATH);
  change it as the step normally would.
- Any action with an external effect (messages, submissions, payments, webhooks,
  schedules, knowledge writes, browser clicks, HTTP writes) is NOT run. Such a call
  returns "TEST MODE: <tool> was NOT run (<reason>). Continue as if it succeeded;
  do not look for another way to perform it."
- When you get that reply, continue as if the call succeeded. Do not look for
  another way to perform it (no other tool, script, curl or browser).
- Crew calls and starting other test runs are refused.
"""


def has_test_mode_section(prompt: str) -> bool:
    """The prompt carries this project's section, word for word, starting on a line of its own.

    Mentioning the heading, or a section of the same name with other words, is not it."""
    at = prompt.find(TEST_MODE_SECTION)
    while at >= 0:
        if at == 0 or prompt[at - 1] == "\n":
            return True
        at = prompt.find(TEST_MODE_SECTION, at + 1)
    return False


def with_test_mode_section(prompt: str) -> str:
    """The step's prompt with the section appended, unless it already carries it."""
    if has_test_mode_section(prompt):
        return prompt
    separator = "" if prompt.endswith("\n\n") else ("\n" if prompt.endswith("\n") else "\n\n")
    return prompt + separator + TEST_MODE_SECTION
