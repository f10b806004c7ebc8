"""The error a recipe's loop raises on itself: the loop helpers (common/training/loop.py, checkpoint.py,
logs.py) check their order and their inputs at run time, and a broken contract is a bug in the recipe,
not in its config. A leaf module (it imports nothing), so that any helper may raise it."""


class ContractError(RuntimeError):
    """A training loop used the helpers out of order, or gave them what they cannot take (a bug in the
    recipe, not in its config)."""
