"""Reading scores files without a model: retained saliency mass per tier and the knee
test (``reap tiers``), ranking comparisons (``reap compare``), their reports and plots."""
