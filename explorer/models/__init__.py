"""Built-in models (real PyTorch modules at several sizes) and synthetic graphs for tests."""

from explorer.models.builtin import BuiltinModel, build, model_names, shape_names
from explorer.models.common import ModelConfigError

__all__ = ["BuiltinModel", "ModelConfigError", "build", "model_names", "shape_names"]
