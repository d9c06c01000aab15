"""The planner: the recipe that fits the card and trains fastest, sized to the data, and why."""
