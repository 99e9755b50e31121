"""tf.data input generators."""
