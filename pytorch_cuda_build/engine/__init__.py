"""The Docker daemon the stages talk to: finding it, its BuildKit client, and starting it where allowed."""
