"""What export, compress and register load and convert: TFLite conversion and inference
(``tflite``) and one predict function per format (``predictors``)."""
