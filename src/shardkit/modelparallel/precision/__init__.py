"""smp's fp16/bf16 training: the FP32 master weights :class:`~shardkit.modelparallel.optimizer.DistributedOptimizer`
keeps (:mod:`.fp16_optimizer`) and the loss scaler with smp's ``dynamic_loss_args`` (:mod:`.loss_scaler`)."""
