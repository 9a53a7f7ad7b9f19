"""What selection needs beside the select stage (tasks/select.py): prompt embeddings for k-means diversity
(embed.py)."""
