"""Tasks shipped with elastictrain (``task: elastictrain.tasks.<name>:build``)."""
