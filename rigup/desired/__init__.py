"""What the control machine decides: knobs, fleet, catalog, recipe, lock and pins, render, release, plan."""
