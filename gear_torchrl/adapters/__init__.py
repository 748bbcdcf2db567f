"""The TorchRL glue: storages, samplers, writer, checkpointer, state dicts, dataset."""
