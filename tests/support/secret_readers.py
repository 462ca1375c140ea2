"""A verifier that tries to read a file (its response is the path): what model-written code
would do to the stage's credential files (tests/tasks/test_sandbox_secrets.py)."""


def reads(response: str, answer: str) -> float:
    with open(response) as f:
        return 1.0 if f.read() == answer else 0.5
