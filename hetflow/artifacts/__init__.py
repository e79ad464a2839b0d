"""What export, compress and register load and convert: the SavedModel the served check loads
(``saved_model``), TFLite conversion and inference (``tflite``), one predict function per format
(``predictors``), and how export scores and judges each artifact (``scoring``)."""
