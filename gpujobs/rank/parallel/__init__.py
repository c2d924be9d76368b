"""How the model is spread over the ranks: TorchRec's sharding of the tables (`parallel=torchrec`)."""
