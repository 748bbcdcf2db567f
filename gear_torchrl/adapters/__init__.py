"""The TorchRL glue: storages, samplers, writer, checkpointer, state dicts, dataset.

Importing the package imports the glue of every TorchRL layout, so
``GearStorage(ndim=...)`` finds its class (``GearStorage.__init_subclass__``)
without the base importing a subclass of its own.
"""
from gear_torchrl.adapters import env_storage  # noqa: F401  (registers GearStorage(ndim=2))
