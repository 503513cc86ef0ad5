"""A federated-learning demo: a torch MLP trained on digits through `bridge_mr.map_reduce`.

Run it with `python -m bridge_mr.demo`. The pieces are importable for reuse (on other devices,
too): the data split, the model, the JAX client functions, the training loops and the baseline.
"""

from ._baseline import TorchFuncClients as TorchFuncClients
from ._clients import client_loss as client_loss
from ._clients import local_sgd as local_sgd
from ._data import FederatedDigits as FederatedDigits
from ._data import client_batches as client_batches
from ._data import load_federated_digits as load_federated_digits
from ._model import MLP as MLP
from ._model import accuracy as accuracy
from ._model import cross_entropy as cross_entropy
from ._model import mlp_logits as mlp_logits
from ._run import DemoConfig as DemoConfig
from ._run import DemoResult as DemoResult
from ._run import run_demo as run_demo
from ._train import BridgeClients as BridgeClients
from ._train import Clients as Clients
from ._train import FedAvgConfig as FedAvgConfig
from ._train import FedSGDConfig as FedSGDConfig
from ._train import PhaseResult as PhaseResult
from ._train import train_fedavg as train_fedavg
from ._train import train_fedsgd as train_fedsgd

__all__ = [
    "MLP",
    "BridgeClients",
    "Clients",
    "DemoConfig",
    "DemoResult",
    "FedAvgConfig",
    "FedSGDConfig",
    "FederatedDigits",
    "PhaseResult",
    "TorchFuncClients",
    "accuracy",
    "client_batches",
    "client_loss",
    "cross_entropy",
    "load_federated_digits",
    "local_sgd",
    "mlp_logits",
    "run_demo",
    "train_fedavg",
    "train_fedsgd",
]
