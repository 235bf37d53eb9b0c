"""One error hierarchy, so every layer reports bad input the same way: file, rule, field, message."""

from __future__ import annotations


class AgentError(Exception):
    """Base of every error the agent raises on purpose."""


class InputError(AgentError):
    """Bad input from a file or the environment, located by file, rule id and field."""

    def __init__(self, message: str, *, file: str = "", rule_id: str = "", field: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.file = file
        self.rule_id = rule_id
        self.field = field

    def line(self) -> str:
        """One line naming where the problem is and what it is."""
        where = [self.file or "<input>"]
        if self.rule_id:
            where.append(f"rule {self.rule_id}")
        if self.field:
            where.append(f"field {self.field}")
        return f"{': '.join(where)}: {self.message}"

    def __str__(self) -> str:
        return self.line()


class ConfigError(InputError):
    """The configuration file or an environment override is invalid."""


class RuleError(InputError):
    """A rules file is invalid."""


class ScenarioError(InputError):
    """A scenario file is invalid."""


class InputErrors(AgentError):
    """Several input problems found at once (a lint run reports them all)."""

    def __init__(self, problems: list[InputError]) -> None:
        super().__init__("\n".join(p.line() for p in problems))
        self.problems = problems

