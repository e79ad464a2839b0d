"""What every stage shares: its receipt and retries (``attempts``), its task log (``task_log``)
and where its time went (``timing``); and which process provisioned a run (``provisioned_by``)."""
