"""Wording shared by messages and reports."""


def count(n: int, word: str, plural: str | None = None) -> str:
    """"1 rank", "2 ranks", "0 step copies" (with `plural`)."""
    return f"{n} {word if n == 1 else plural or word + 's'}"
