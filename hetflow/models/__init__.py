"""The Keras models (``architectures``) and the learning-rate and batch schedule both training
and fine-tuning use (``schedule``)."""
