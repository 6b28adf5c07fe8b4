"""Image captioning (CapRL): synthetic scenes with QA, CapRL-QA-shaped data, the QA filter and the task."""
