"""Where does IsoLoCo beat a tuned DiLoCo after 10 outer rounds? One knob at a time from the base cell (v1, v3)."""
