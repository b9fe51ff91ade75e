"""Callbacks for loops a trainer owns (HF Trainer, Lightning, MindSpore Model.train), built on
:class:`trainmon.monitor.TrainerMonitor` and its public seam (``guard``, ``lifecycle``). Nothing imports them."""
