"""Reports on what training and a search found (``nats analyze``): routing statistics per
layer, the token view, the cost of an architecture against the pure forms, and a search's
front. What lower layers also need lives below: the softmax fraction and the cost model in
:mod:`nats` (``nats.softmax_fraction``, ``nats.cost_model``), routing maps in
:mod:`nats.trainers.routing_maps`, the Pareto front in :mod:`nats.search_spaces.pareto`."""
