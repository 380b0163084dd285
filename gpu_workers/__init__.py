"""Worker processes: one per GPU (CUDA_VISIBLE_DEVICES), or CPU workers; batching and inference."""
