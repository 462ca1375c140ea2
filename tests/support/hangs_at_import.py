"""A verifier module whose import never returns (imported in the sandbox's template)."""

from tests.support.hostile_verifiers import hangs_on_import

hangs_on_import()


def verify(response: str, answer: str) -> float:
    return 1.0
