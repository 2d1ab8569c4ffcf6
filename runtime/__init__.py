"""The runtime every training job imports: job context, data, loader, checkpoint, preflight."""
