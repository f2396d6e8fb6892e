"""Reward functions for the GRPO walk-through (docs/post_training.md): each takes (prompt, completion, row) and
returns a number. The rows of examples/arith/prompts_*.jsonl are {"prompt": "3+9=", "answer": 12}."""


def correct(prompt: str, completion: str, row: dict) -> float:
  """1 for the right sum, 0 otherwise."""
  return float(completion.strip() == str(row['answer']))


def digits(prompt: str, completion: str, row: dict) -> float:
  """The share of the completion that is digits (partial credit while the model cannot add yet); 0 if empty."""
  return sum(c.isdigit() for c in completion) / len(completion) if completion else 0.0
