"""What export, compress and register load and convert: the SavedModel the served check loads
(``saved_model``), TFLite conversion and inference (``tflite``) and one predict function per format
(``predictors``)."""
