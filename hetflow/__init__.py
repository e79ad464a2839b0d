"""hetflow: distributed TensorFlow training driven by an Airflow DAG, tracked in MLflow.

tensorflow-model-optimization and ParameterServerStrategy need tf_keras (Keras 2), and Keras 3's
``model.fit`` breaks under MultiWorkerMirroredStrategy on TF 2.21. ``TF_USE_LEGACY_KERAS`` makes
``tf.keras`` resolve to tf_keras; it must be set before TensorFlow is first imported, so it is set
here, the one place every hetflow module passes through.
"""

import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"
