-- Routes per sender domain (DESIGN §13): a row may name the route it takes;
-- NULL takes the route its From domain selects, or transport.*.
ALTER TABLE mail_queue ADD COLUMN route VARCHAR(64) NULL;
