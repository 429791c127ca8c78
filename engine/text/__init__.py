"""Text services around translation, pure functions with no engine or model state:
segmentation of documents (segment), language identification and output warnings."""
