"""Text-to-video: generated clips of a moving coloured shape with their prompts (see `clips`)."""
