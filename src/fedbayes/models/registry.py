"""Models by name: the model registry, one :class:`ModelSpec` per model.

A spec holds the name used in configs (``[model] name = ...``), the
:class:`~fedbayes.hparams.HParams` record of the ``[model]`` keys only it reads (``settings``), its
builder ``build(settings, num_classes, variational) -> flax module`` and its traits: the tasks it
is built for, whether it needs image input or takes token ids, whether it has a variational
version. The run's checks of a model against the data (``fedbayes.runs.build.check_model``) read
these traits, never the model's name. A model added with :func:`register` runs from a config file
like a built-in one, and the conformance suite (``tests/models/test_model_conformance.py``) builds
every registered model on data of a matching shape and checks that a mismatched one is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

if TYPE_CHECKING:
    import flax.linen as nn

from pydantic import Field

from fedbayes.hparams import HParams
from fedbayes.models.tasks import ACTIVATIONS, TASKS
from fedbayes.registries import Registry

__all__ = ["ModelSettings", "ModelSpec", "builtin_specs", "get", "names", "register", "setting", "specs", "unregister"]


class ModelSettings(HParams):
    """Base of a model's own settings: the ``[model]`` keys only it reads."""

    section: ClassVar[str] = "model."


def setting(model: Any, key: str, default: Any = None) -> Any:
    """``key`` of a model config given as a record (attribute access) or as a raw mapping."""
    if isinstance(model, Mapping):
        return model.get(key, default)
    return getattr(model, key, default)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A registered model.

    Attributes:
      name: registry key, the config's ``model.name``.
      description: one line on what the model is.
      build: ``(settings, num_classes, variational) -> flax.linen.Module``; ``settings`` is the
        ``[model]`` config (its keys read as attributes: the common ones and this model's own).
        The module maps float32 inputs ``[batch, *feature_shape]`` to outputs ``[batch, num_classes]``
        (a regression: ``[batch]``; next-word prediction: ``[batch, T, vocabulary]``).
      settings: the :class:`ModelSettings` record of the ``[model]`` keys only this model reads
        (``None``: none); a config's values of these keys are validated through it.
      tasks: the data tasks it is built for (:data:`fedbayes.models.TASKS`).
      image: it needs image input ``[H, W]`` or ``[H, W, C]``.
      tokens: it takes token ids (text) as input; a model without it takes float features only.
      variational: it has a variational version (``model.variational = true``).
      imported: it is the user's own module (``model.module``, or passed from Python).
      exclusive: keys of ``settings`` that a config naming another model must leave at their defaults.
    """

    name: str
    description: str
    build: Callable[[Any, int, bool], nn.Module]
    settings: type[ModelSettings] | None = None
    tasks: tuple[str, ...] = ("classification",)
    image: bool = False
    tokens: bool = False
    variational: bool = False
    imported: bool = False
    exclusive: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"ModelSpec: name must be a non-empty string; got {self.name!r}")
        if self.settings is not None and not (isinstance(self.settings, type) and issubclass(self.settings, HParams)):
            raise ValueError(f"ModelSpec {self.name!r}: settings must be an HParams subclass; got {self.settings!r}")
        bad = [t for t in self.tasks if t not in TASKS]
        if not self.tasks or bad:
            raise ValueError(f"ModelSpec {self.name!r}: tasks must be some of {', '.join(TASKS)}; got {self.tasks!r}")
        for key in self.exclusive:
            if key not in self.setting_keys:
                raise ValueError(f"ModelSpec {self.name!r}: {key!r} is not a key of its settings")

    @property
    def setting_keys(self) -> tuple[str, ...]:
        """The ``[model]`` keys only this model reads."""
        return tuple(self.settings.model_fields) if self.settings is not None else ()


class MLPSettings(ModelSettings):
    """The MLP's widths and nonlinearity."""

    hidden: tuple[Annotated[int, Field(ge=1)], ...] = (200, 100)
    activation: Literal[tuple(ACTIVATIONS)] = Field("relu", description="mlp hidden-layer nonlinearity (the FedLap authors' code uses sigmoid)")  # type: ignore[valid-type]


class ResNetSettings(ModelSettings):
    """ResNet-18 (GroupNorm)'s width."""

    width: int | None = Field(None, ge=1, description="resnet18_gn: first-stage channels (64); lstm_nwp: LSTM units (670)")


class LSTMSettings(ModelSettings):
    """The next-word LSTM's sizes."""

    width: int | None = Field(None, ge=1, description="resnet18_gn: first-stage channels (64); lstm_nwp: LSTM units (670)")
    embed_dim: int | None = Field(None, ge=1, description="lstm_nwp: embedding size (96)")


class ModuleSettings(ModelSettings):
    """Your own flax module (:mod:`fedbayes.models.imported`)."""

    module: str | None = Field(None, description="your own flax module: 'package.module:Class' or 'path/to/file.py:Class' (sets name = 'module')")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="module: its keyword arguments (num_classes is set from the data unless given)")


def make_model(name: str, num_classes: int, **kwargs) -> nn.Module:
    """:func:`fedbayes.models.make_model`, loaded when a model is first built."""
    from fedbayes.models.core import make_model as make

    return make(name, num_classes, **kwargs)


def _plain(name: str) -> Callable[[Any, int, bool], nn.Module]:
    return lambda m, num_classes, variational: make_model(name, num_classes, variational=variational)


def _mlp(m, num_classes: int, variational: bool) -> nn.Module:
    return make_model("mlp", num_classes, variational=variational, hidden=tuple(setting(m, "hidden", (200, 100))), activation=setting(m, "activation", "relu"))


def _resnet(m, num_classes: int, variational: bool) -> nn.Module:
    width = setting(m, "width")
    return make_model("resnet18_gn", num_classes, variational=variational, **({"width": width} if width is not None else {}))


def _lstm(m, num_classes: int, variational: bool) -> nn.Module:
    kwargs = {k: v for k, v in (("hidden", setting(m, "width")), ("embed_dim", setting(m, "embed_dim"))) if v is not None}
    return make_model("lstm_nwp", num_classes, variational=variational, **kwargs)


def _module(m, num_classes: int, variational: bool) -> nn.Module:
    from fedbayes.models.imported import make_module

    return make_module(setting(m, "module"), setting(m, "kwargs", {}), num_classes)


_BUILTIN: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("logreg", "multinomial logistic regression (a softmax layer)", _plain("logreg"), tasks=("classification", "multilabel")),
        ModelSpec("mlp", "a multilayer perceptron", _mlp, MLPSettings, tasks=("classification", "multilabel"), variational=True, exclusive=("activation",)),
        ModelSpec("cnn", "the two-convolution CNN of McMahan et al. 2017", _plain("cnn"), image=True, variational=True),
        ModelSpec("linear", "linear regression", _plain("linear"), tasks=("regression",)),
        ModelSpec("emnist_cnn", "EMNIST-62's CNN (Reddi et al. 2021)", _plain("emnist_cnn"), image=True),
        ModelSpec("resnet18_gn", "ResNet-18 with GroupNorm for CIFAR-100", _resnet, ResNetSettings, image=True),
        ModelSpec("lstm_nwp", "StackOverflow next-word LSTM", _lstm, LSTMSettings, tasks=("next_word",), tokens=True),
        ModelSpec("module", "your own flax module (model.module, or passed from Python)", _module, ModuleSettings, imported=True),
    )
}


_REGISTRY = Registry.of("model", ModelSpec, _BUILTIN)


def register(spec: ModelSpec) -> ModelSpec:
    """Adds a model; a config naming it (``[model] name = ...``, its own keys flat in ``[model]``)
    then validates and runs like a built-in one.

    Raises:
      ValueError: the name is taken, or ``spec`` is not a :class:`ModelSpec`.
    """
    return _REGISTRY.register(spec)


def unregister(name: str) -> None:
    """Removes a model added by :func:`register` (a name never registered is no error).

    Raises:
      ValueError: ``name`` is built in (built-in models stay).
    """
    _REGISTRY.unregister(name)


def get(name: str) -> ModelSpec:
    """The spec of ``name``; an unknown name raises ``ValueError`` listing the known ones."""
    return _REGISTRY.get(name)


def names() -> tuple[str, ...]:
    """Every registered name, built-in ones first."""
    return _REGISTRY.names()


def specs() -> tuple[ModelSpec, ...]:
    """Every registered spec."""
    return _REGISTRY.specs()


def builtin_specs() -> tuple[ModelSpec, ...]:
    """The models that ship with fedbayes."""
    return _REGISTRY.builtin_specs()
