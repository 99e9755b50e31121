"""lingvo_gpipe: GPipe pipeline parallelism for TensorFlow 2."""
