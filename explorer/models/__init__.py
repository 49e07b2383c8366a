"""Built-in models (real PyTorch modules at several sizes) and synthetic graphs for tests."""

from explorer.models.builtin import BuiltinModel, build, model_names

__all__ = ["BuiltinModel", "build", "model_names"]
