"""The DAG's ten tasks, one module per task id, each holding a function of the same name.

``dags/hetflow_train.py`` only wires them. A stage imports libraries from the rest of ``hetflow``,
never another stage; what one stage tells the next goes through the run directory's records or
its return value."""
