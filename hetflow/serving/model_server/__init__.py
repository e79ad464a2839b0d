"""The endpoint's model server: a folder run inside the sandbox as ``python -I model_server ...``
(its ``__main__.py``), its modules importing each other by plain name; of it the pipeline imports
``limits`` alone (it imports nothing)."""
